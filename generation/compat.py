"""The transformers releases DSpark's `generate()` integration is tested with, and the check that enforces them.

`target.generate(ids, assistant_model=drafter)` reaches DSpark through transformers' private internals: the
candidate-generator chain (`GenerationMixin._get_candidate_generator`, wrapped by
:func:`modeling_dspark.install_generate_hook`) and the assisted-decoding loop that drives a `CandidateGenerator`
(`generation.candidate_generator`). These change between releases without notice (5.25 asks the generator for
``num_drafting_tokens``; 5.15 cannot read the packaged targets' GGUF with the current ``gguf``), so `generate()` with a
DSpark drafter runs only on the releases CI tests (`.ci/run`); pyproject.toml declares the same range.
"""

from __future__ import annotations

TRANSFORMERS_MIN = "5.24.0"
"""The lowest transformers release supported (inclusive)."""
TRANSFORMERS_BELOW = "5.25"
"""The first transformers release not supported (exclusive): the next minor release after the highest tested."""


def supported_transformers() -> str:
    """The supported range as a pip requirement specifier, e.g. ``">=5.24.0,<5.25"``."""
    return f">={TRANSFORMERS_MIN},<{TRANSFORMERS_BELOW}"


def check_transformers(version: str | None = None) -> None:
    """Refuse a transformers release outside :func:`supported_transformers` before `generate()` uses its internals.

    Args:
        version: the release to check (default: the installed ``transformers.__version__``).

    Raises:
        RuntimeError: the release is outside the range; the message names the installed and supported versions and
            the pip command that installs a supported one.
    """
    from packaging.specifiers import SpecifierSet

    if version is None:
        import transformers

        version = transformers.__version__
    # pip's reading of the range: a pre-release of the excluded release is excluded too
    if not SpecifierSet(supported_transformers()).contains(version, prereleases=True):
        raise RuntimeError(
            f"generate(assistant_model=<DSpark drafter>) needs transformers {supported_transformers()} (its private "
            f"candidate-generator and assisted-decoding internals are tested on those releases only); installed: "
            f"transformers {version}. Install a supported release: pip install 'transformers{supported_transformers()}'"
        )
