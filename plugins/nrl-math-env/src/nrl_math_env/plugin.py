"""Registers the math environments and datasets with nrl.

Targets and config classes are ``"module:attr"`` strings: loading the plugin imports nothing
but this file, and the environments are imported only in their Ray actors.
"""

from nrl_core import hookimpl

_CONFIG = "nrl_math_env.config:"


@hookimpl
def nrl_register_environments(register):
    """The ``math``, ``arithmetic`` and ``guess_number`` environments."""
    register(
        "math",
        "nrl_math_env.math_env:MathEnvironment",
        extras=["verify"],
        config=_CONFIG + "MathEnvConfig",
        description="reward 1 when math-verify finds the answer equal to the reference",
    )
    register(
        "arithmetic",
        "nrl_math_env.arithmetic:ArithmeticEnvironment",
        description="generated integer arithmetic with exact-answer reward",
    )
    register(
        "guess_number",
        "nrl_math_env.guess_number:GuessNumberEnvironment",
        config=_CONFIG + "GuessNumberEnvConfig",
        description="multi-turn number guessing; the environment answers higher or lower",
    )


@hookimpl
def nrl_register_datasets(register):
    """Generated and shipped sets, JSONL files, and four Hugging Face math datasets."""
    datasets = [
        ("arithmetic", "arithmetic:ArithmeticDataset", "ArithmeticDataConfig",
         "generated integer arithmetic (12+7= -> 19), deterministic from the seed"),
        ("guess_number", "guess_number:GuessNumberDataset", "GuessNumberDataConfig",
         "games of the guess_number environment, secrets drawn from the seed"),
        ("word_problems", "loaders:WordProblemsDataset", "WordProblemsDataConfig",
         "400 generated grade-school word problems shipped in the package"),
        ("jsonl", "loaders:JsonlDataset", "JsonlDataConfig",
         "a JSONL file with problem and answer fields"),
        ("gsm8k", "loaders:GSM8KDataset", "HFDatasetConfig",
         "openai/gsm8k (needs the hf extra or a local copy)"),
        ("math500", "loaders:Math500Dataset", "HFDatasetConfig",
         "HuggingFaceH4/MATH-500, validation only (needs the hf extra or a local copy)"),
        ("openmathinstruct2", "loaders:OpenMathInstruct2Dataset", "HFDatasetConfig",
         "nvidia/OpenMathInstruct-2 train_1M (needs the hf extra or a local copy)"),
        ("dapo_math_17k", "loaders:DapoMath17kDataset", "HFDatasetConfig",
         "BytedTsinghua-SIA/DAPO-Math-17k (needs the hf extra or a local copy)"),
    ]  # fmt: skip
    # The hub datasets read with Hugging Face `datasets` (the `hf` extra): declared, so that
    # `nrl doctor` reports it missing (the loaders import it only when they run).
    hub = {"gsm8k", "math500", "openmathinstruct2", "dapo_math_17k"}
    for name, target, config, description in datasets:
        register(
            name,
            "nrl_math_env." + target,
            config=_CONFIG + config,
            extras=["hf"] if name in hub else [],
            description=description,
        )
