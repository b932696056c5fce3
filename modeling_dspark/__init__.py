"""DSpark draft models for Hugging Face transformers (docs/method.md §2–§5).

Importing this package registers `DSparkConfig` / `DSparkDraftModel` with `AutoConfig` / `AutoModel`, so
`AutoModel.from_pretrained(drafter_dir)` works without `trust_remote_code`.
"""

from transformers import AutoConfig, AutoModel

from .configuration_dspark import DSparkConfig, default_target_layer_ids
from .modeling_dspark import DSparkDraftModel, DSparkOutput

AutoConfig.register("dspark", DSparkConfig, exist_ok=True)
AutoModel.register(DSparkConfig, DSparkDraftModel, exist_ok=True)

__all__ = ["DSparkConfig", "DSparkDraftModel", "DSparkOutput", "default_target_layer_ids"]
