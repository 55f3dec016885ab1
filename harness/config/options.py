"""The schema of the open tables of a protocol: a method's options (``[methods.<name>]``)
and a loss's arguments (``[loss.args.<name>]``).

A method's options are declared by its plugin: the keyword arguments of its constructor,
their annotations and defaults (:meth:`harness.methods.base.MethodEntry.option_types`). They
become one strict pydantic model per method, so that ``nan``, ``"4"`` or ``true`` for a
number is refused when the protocol is read, for every method it configures, run or not.
A plugin's constructor still checks what relates its options (groups dividing the
embedding size), when the method is built for a run.

Loss arguments are PML's constructor arguments, unannotated there: the ranges below are
declared by name, whichever loss takes them; every other number must be finite.
"""

from __future__ import annotations

import functools
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model

from harness.config.schema import OPTIONS_CONFIG, Float, Int, refusal
from harness.methods import METHODS

__all__ = ["check_option_values", "check_loss_arg_values", "options_model", "LossArguments"]


@functools.cache
def options_model(method: str) -> type[BaseModel]:
    """The pydantic model of ``method``'s options: each option's declared type, its
    default (the variant's preset where it has one), no other key."""

    entry = METHODS.get(method)
    types, defaults = entry.option_types(), entry.options()
    return create_model(
        f"{method} options",
        __config__=OPTIONS_CONFIG,  # type: ignore[call-overload]  # mypy matches the **dict against the named __base__ etc.
        **{name: (types[name], defaults[name]) for name in defaults},
    )


def check_option_values(method: str, options: dict[str, Any]) -> None:
    """Refuse a value of ``[methods.<method>]`` that its declared type does not allow."""
    try:
        options_model(method).model_validate(options)
    except ValidationError as err:
        raise refusal(
            err,
            options_model(method).model_json_schema(),
            what="protocol key",
            prefix=("methods", method),
        ) from None


#: Any finite margin: a negative one asks for the opposite ordering, and MLRC's searches
#: start at -0.2 (:mod:`harness.components.losses.search_spaces`).
_Margin = Float | None
_Scale = Annotated[Float, Field(gt=0)] | None
#: A value of an argument without a declared range: any finite number, string or flag.
_Value = bool | int | float | str | list[Any] | dict[str, Any] | None


class LossArguments(BaseModel):
    """Ranges of loss arguments, by name, whichever loss takes them. Margins are gaps
    between distances or similarities (a negative one asks for the opposite ordering),
    scales and temperatures divide or multiply similarities. The loss's own constructor
    refuses names it does not take (:func:`harness.components.losses.check_loss_args`)."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    __pydantic_extra__: dict[str, _Value]

    margin: _Margin = None
    margin2: _Margin = None
    pos_margin: _Margin = None
    neg_margin: _Margin = None
    #: Circle loss's relaxation margin.
    m: _Margin = None
    alpha: _Scale = None
    scale: _Scale = None
    softmax_scale: _Scale = None
    temperature: _Scale = None
    #: SoftTriple's lambda (scale) and gamma.
    la: _Scale = None
    gamma: _Scale = None
    centers_per_class: Annotated[Int, Field(ge=1)] | None = None


def check_loss_arg_values(args: dict[str, dict[str, Any]]) -> None:
    """Refuse a value of ``[loss.args.<loss>]`` out of its declared range, or not finite."""
    for loss, values in args.items():
        try:
            LossArguments.model_validate(values)
        except ValidationError as err:
            raise refusal(
                err,
                LossArguments.model_json_schema(),
                what="protocol key",
                prefix=("loss", "args", loss),
            ) from None
