"""Registers the math environments and datasets with nrl."""

from nrl_core import hookimpl


@hookimpl
def nrl_register_environments(register):
    register(
        "math",
        "nrl_math_env.math_env:MathEnvironment",
        extras=["verify"],
        config="nrl_math_env.config:MathEnvConfig",
        description="reward 1 when math-verify finds the answer equal to the reference",
    )
    register(
        "arithmetic",
        "nrl_math_env.arithmetic:ArithmeticEnvironment",
        config="nrl_math_env.config:ArithmeticEnvConfig",
        description="generated integer arithmetic with exact-answer reward",
    )
