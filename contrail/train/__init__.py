"""Training: the masked-token trainer (shared by SFT and GRPO), demonstrations, behaviour cloning."""
