"""Options of the math environments (``env.math``, ``env.arithmetic``). Import-light: only attrs."""

import attrs

from nrl_core.config.schema import option


@attrs.define
class MathEnvConfig:
    num_workers: int = option(2, "Verifier actors.")
    timeout_s: float = option(5.0, "Time limit of one verification; over it the reward is 0.")


@attrs.define
class ArithmeticEnvConfig:
    pass
