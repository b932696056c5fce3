"""DSpark inference: candidate generator for `generate()`, verify policies, scheduler, statistics.

Never imports training code.
"""

from .candidate_generator import DSparkCandidateGenerator
from .integration import dspark_options
from .policies import ConfidenceThreshold, FixedLength, FullBlock, PrefixScheduler, VerifyPolicy, make_policy
from .stats import GenerationStats, RoundStats, collect_stats
from .engine import DSparkEngine, RequestOutput, generate_batch
from .profiling import SPSCurve, SPSProfile, ensure_profile, load_profile, load_sps

__all__ = [
    "DSparkCandidateGenerator",
    "dspark_options",
    "VerifyPolicy",
    "FullBlock",
    "FixedLength",
    "ConfidenceThreshold",
    "PrefixScheduler",
    "make_policy",
    "GenerationStats",
    "RoundStats",
    "collect_stats",
    "DSparkEngine",
    "RequestOutput",
    "generate_batch",
    "SPSCurve",
    "SPSProfile",
    "ensure_profile",
    "load_profile",
    "load_sps",
]
