"""Training a DSpark drafter: `DSparkTrainer` (eqs. 11–14), losses, training data and prompts, the target feature
cache, STS calibration fitting and LoRA adaptation.

Imports the model package (`modeling_dspark`); neither `modeling_dspark` nor `generation` imports this package.
"""
