"""Run configuration: attrs schemas (:mod:`.schema`) and YAML loading (:mod:`.loader`)."""
