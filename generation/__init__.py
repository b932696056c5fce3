"""DSpark inference: the drafting round, the round's decisions, verify policies, Algorithm 1, `generate()` integration,
the batched engine and statistics (SPS(B) tables are measured by :mod:`dspark.evaluation.profiling`). Never imports the
model package (`modeling_dspark`: a drafter is known by the methods called on it), training or evaluation code."""

if __name__ == "generation":  # the folder imported as a top-level package: a second, unconnected copy
    raise ImportError("this package is dspark.generation: import dspark.generation (top-level 'generation' is "
                      "not dspark's, and a second copy would not share its options or statistics)")

from .candidate_generator import DSparkCandidateGenerator  # noqa: E402
from .drafting import draft_round
from .engine import DSparkEngine, RequestOutput, generate_batch
from .integration import dspark_options
from .policies import POLICY_NAMES, Policy, parse_policy
from .stats import GenerationStats, RoundStats, collect_stats

__all__ = ["DSparkCandidateGenerator", "draft_round", "DSparkEngine", "RequestOutput", "generate_batch",
           "dspark_options", "POLICY_NAMES", "Policy", "parse_policy", "GenerationStats", "RoundStats", "collect_stats"]
