"""Transitional: :class:`~commhooks.facts.EngineFacts` moved to :mod:`commhooks.facts`.

Only ``algorithms/base.py`` still imports from here (its next revision imports ``EngineFacts`` and
``for_model`` from :mod:`commhooks.facts`); delete this module with that change.
"""

from ..facts import EngineFacts
from ..facts import for_model as _facts_of_hand_built_state

__all__ = ["EngineFacts", "_facts_of_hand_built_state"]
