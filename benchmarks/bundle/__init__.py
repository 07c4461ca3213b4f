"""What ``benchmarks/gpu_bundle.py`` builds: :mod:`.wheels` (nrl's bundle) and
:mod:`.vllm_chain` (vLLM's bundle and the chain of device calls). ``benchmarks/`` is not an
installed package: the script puts its folder on ``sys.path``."""
