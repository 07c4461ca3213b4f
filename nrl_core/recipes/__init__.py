"""YAML recipes embedded in nrl_core (see nrl_core.algorithms.recipes)."""
