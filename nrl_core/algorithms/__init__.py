"""The training algorithms (GRPO, SFT, DPO, RM) and their shared pieces."""
