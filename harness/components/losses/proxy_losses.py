"""Losses against learned class proxies that PML computes differently from the seeds."""

from __future__ import annotations

from pytorch_metric_learning import losses as pml_losses

from harness.base.errors import HarnessError

__all__ = ["ProxyAnchorLoss"]


class ProxyAnchorLoss(pml_losses.ProxyAnchorLoss):
    """PML's ProxyAnchorLoss (Kim et al. 2020, Eq. 4) with an optional negative margin of its
    own: positive terms alpha (m_p - cos), negative terms alpha (cos + m_n), m_p = ``margin``,
    m_n = ``neg_margin`` (None: ``margin``, PML's loss exactly).

    AVSL's released SOP script (zbr17/AVSL examples/samples_avsl.sh, line 10: ``--pa_pos_margin
    1.8 --pa_neg_margin 2.4 --pa_alpha 16`` on squared distances of unit vectors, d^2 = 2 - 2 cos)
    is m_p = 0.1, m_n = 0.2, alpha = 32 here. PML's terms use one margin m; on the shifted
    similarity cos + s with m = (m_p + m_n) / 2 and s = (m_n - m_p) / 2 they are exactly the
    two-margin terms, so PML's masking, miner weights and reduction are kept unchanged."""

    def __init__(self, num_classes, embedding_size, *, neg_margin: float | None = None, **kwargs):
        super().__init__(num_classes, embedding_size, **kwargs)
        self.neg_margin = None if neg_margin is None else float(neg_margin)
        self._shift = 0.0  # nonzero only inside compute_loss

    def compute_loss(self, embeddings, labels, indices_tuple, ref_emb, ref_labels):
        if self.neg_margin is None or self.neg_margin == self.margin:
            return super().compute_loss(embeddings, labels, indices_tuple, ref_emb, ref_labels)
        if not self.distance.is_inverted:
            raise HarnessError("proxy_anchor's neg_margin needs a similarity (cosine) distance")
        pos_margin = self.margin
        self.margin = (pos_margin + self.neg_margin) / 2
        self._shift = (self.neg_margin - pos_margin) / 2
        try:
            return super().compute_loss(embeddings, labels, indices_tuple, ref_emb, ref_labels)
        finally:
            self.margin, self._shift = pos_margin, 0.0

    def get_logits(self, embeddings):
        return super().get_logits(embeddings) + self._shift
