"""The planner: which tagged tensors to keep, swap to host, or recompute.

Pure standard-library Python, no framework imports: a `Graph` of ops and
tagged tensors goes in, a `Plan` comes out. `simulate` scores a plan on a
timeline of one training step; `POLICIES` are the decision rules and
`make_plan` picks one that fits a memory budget.
"""

from .cost import CostModel
from .graph import Graph
from .graph import OpSpec
from .graph import TensorSpec
from .plan import Plan
from .plan import PlanError
from .plan import format_bytes
from .plan import memory_line
from .plan import overhead_text
from .choose import POLICIES
from .choose import REQUIRES
from .choose import in_flight_bounds
from .choose import make_plan
from .choose import repredicted
from .simulate import SimResult
from .simulate import simulate

__all__ = [
    "CostModel",
    "Graph",
    "OpSpec",
    "Plan",
    "PlanError",
    "POLICIES",
    "REQUIRES",
    "SimResult",
    "TensorSpec",
    "format_bytes",
    "in_flight_bounds",
    "memory_line",
    "overhead_text",
    "make_plan",
    "repredicted",
    "simulate",
]
