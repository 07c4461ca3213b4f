"""nrl plugin: NeMo Gym environments driven by their own agents against nrl's policy endpoint."""
