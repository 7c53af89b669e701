"""Packing plans: which pieces of which documents fill each row.

`plan(lengths, seq_len, strategy=...)` returns a `Plan`; `load_or_plan` caches it on disk;
`PlanOptions` holds the settings of a plan as one group. See docs/packing.md.
"""

from segpack.packing.cache import load_or_plan, plan_key
from segpack.packing.chunking import LONG_DOC_MODES, LongDocs, PackingArgumentError
from segpack.packing.options import PlanOptions
from segpack.packing.plan_format import Plan, PlanError
from segpack.packing.planner import STRATEGIES, RepackPlanner, plan

__all__ = ["LONG_DOC_MODES", "STRATEGIES", "LongDocs", "PackingArgumentError", "Plan",
           "PlanError", "PlanOptions", "RepackPlanner", "load_or_plan", "plan", "plan_key"]
