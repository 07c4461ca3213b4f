"""Test helpers shipped with nrl (tiny model builder, fixtures); submodules import torch lazily."""
