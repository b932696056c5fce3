"""Training a DSpark drafter: `DSparkTrainer` (eqs. 11–14), losses, training data and prompts, the target feature
cache, held-out prompts and STS calibration fitting, and LoRA adaptation.

Imports `modeling_dspark` and `generation`; neither of them imports this package.
"""
