"""QSR: local SGD / local AdamW gated by the Quadratic Synchronisation Rule (arXiv 2310.14423).

Read in this order: :mod:`.config` (the keys, the rule, the tuning advice), :mod:`.state` (the state and the round:
when a sync happens), :mod:`.sync` (what a sync does: a plain mean or an outer step per fragment), :mod:`.plan`
(what a sync covers, decided at set-up), :mod:`.saved` (its checkpoint and memory), :mod:`.traffic` (the bytes it
declares, replaying the same rounds).
"""

from .config import QSRConfig, QuadraticRuleFields
from .plan import SyncPlan, check_layout
from .state import QSRState, Round, qsr_period, rule_period
from .traffic import qsr_traffic

__all__ = ["QSRConfig", "QSRState", "QuadraticRuleFields", "Round", "SyncPlan", "check_layout", "qsr_period",
           "qsr_traffic", "rule_period"]
