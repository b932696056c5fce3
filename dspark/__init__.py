"""DSpark: confidence-scheduled speculative decoding for Hugging Face transformers.

The model is the separate top-level package ``modeling_dspark`` (``DSparkDraftModel``, ``DSparkConfig``); the rest
lives here:

- :mod:`dspark.generation`: decoding (the ``generate()`` candidate generator, the batched engine, verify policies);
- :mod:`dspark.training`: data, losses, the trainer, calibration fits;
- :mod:`dspark.evaluation`: τ on the eval sets, acceptance by position, SPS(B) profiles, the serving benchmark;
- :mod:`dspark.cli`: the ``dspark`` command (``python -m dspark.cli``);
- :mod:`dspark.app_render`: the demo page's rendering (the page itself is ``app.py`` in the repository).

Importing ``dspark`` imports none of them.
"""

import importlib.abc
import importlib.util
import sys
from pathlib import Path


class _CheckoutGeneration(importlib.abc.MetaPathFinder):
    """Finds ``dspark.generation`` (and nothing else) in a checkout's top-level folder generation/."""

    def __init__(self, init_file: Path):
        self.init_file = init_file

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "dspark.generation":
            return None
        return importlib.util.spec_from_file_location(fullname, self.init_file,
                                                      submodule_search_locations=[str(self.init_file.parent)])


# In the repository, dspark.generation's source is the top-level folder generation/ (setuptools' package-dir maps it
# into the wheel as dspark/generation/). Run from a checkout (PYTHONPATH, or the folder as the working directory),
# dspark.generation is that checkout's generation/, ahead of any installed copy.
_here = Path(__file__).resolve().parent
if not (_here / "generation").is_dir() and (_here.parent / "generation" / "__init__.py").is_file():
    sys.meta_path.insert(0, _CheckoutGeneration(_here.parent / "generation" / "__init__.py"))
del _here


def __getattr__(name: str):
    if name == "__version__":  # read on first use: importing dspark stays free of metadata scans
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version("dspark")
        except PackageNotFoundError:
            return "0+unknown"
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
