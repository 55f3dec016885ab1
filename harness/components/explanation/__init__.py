"""Explanation maps (resizing, figures, part statistics) and their scores (pointing game,
part share, deletion and insertion curves): generic over plugins."""
