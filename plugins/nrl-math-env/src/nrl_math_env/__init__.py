"""nrl plugin: math and arithmetic environments, a multi-turn game, and math datasets.

See the plugin's README for what it registers and how to write an environment like these.
"""
