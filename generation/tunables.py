"""Every tunable of decoding, named and explained in one place (the modules that read them import them from here).

Each value was chosen as its docstring says; changing one changes decisions (how much is verified, when the drafter
runs), never the output: every decision reads only the committed text and earlier rounds."""

from __future__ import annotations

# ---------------------------------------------------------------------------------------------- verify policies
DEFAULT_LAG = 2
"""Rounds between the confidences ``lagged`` reads and the round whose verify budget they set."""

PLAIN_EVERY = 16
"""A priced run takes a plain step (B = R) after this many rounds without one, to measure t(R) again: prices learned
on a busy machine would otherwise stay as they were for the action the scheduler stopped taking."""

PROBE_EVERY = 16
"""A priced run verifies :data:`PROBE_TOKENS` drafted token per request, whatever it costs, after this many rounds
without a multi-token verify, to measure drafting and a verify again (a decision fixed before the round: lossless)."""

PROBE_TOKENS = 1
"""Draft tokens per request a probe round verifies."""

# ---------------------------------------------------------------------------------------------- prices (costs.py)
VERIFY_DECAY = 0.95
"""Weight of a verify observation per later one of the same request count (a line follows ~20 such rounds)."""

PRIOR_SLOPE = 0.25
"""The prior cost of a verified token beyond the anchors, as a fraction of a plain step (through the first round)."""

PLAIN_DECAY = 0.8
"""Weight of the plain-step average per later plain step."""

PRIOR_WEIGHT = 4.0
"""Weight of the prior slope, in units of the rounds' spread Σw(B − B̄)² (tokens²): two rounds 2 tokens apart
outweigh it."""

DRAFT_DECAY = 0.8
"""Weight of the drafting-time average per later drafting round."""

ACCEPT_DECAY = 0.9
"""Per-round decay of a proposer's accepted and tried counts."""

PRIOR_ACCEPT = 0.7
"""The acceptance per position a proposer is expected to have before (or long after) its rounds are seen."""

PRIOR_STRENGTH = 2.0
"""Pseudo-trials of the prior."""

MIN_VERIFY_S = 1e-6
"""The least a verify is priced at (seconds): a fitted line may reach 0 or below at small B."""

# ---------------------------------------------------------------------------------------------- lookup
NUM_TOKENS = 10
"""K, the most tokens the lookup proposes per round where no drafter sets it to γ'."""

MIN_NGRAM = 2
"""The shortest suffix n that counts as a match: a single repeated token is too common a coincidence to copy on."""
MAX_NGRAM = 3
"""The longest n-gram the lookup matches (the most recent occurrence of the last 2–3 committed tokens)."""

# ---------------------------------------------------------------------------------------------- drafting round
EAGER_LOGITS_ROWS = 64
"""Up to this many (request, slot) rows, the base logits U_k of every slot come from ONE LM-head product: with few
rows the product is bound by reading the head's weights, so computing unneeded slots costs little."""
