"""RL objective: group advantages and the clipped surrogate."""
from knittrans_jax.rl.advantages import group_advantages
from knittrans_jax.rl.losses import (LossConfig, nll_loss_sum, ppo_loss_sum, ppo_token_terms,
                                     token_logprobs)

__all__ = ["LossConfig", "group_advantages", "nll_loss_sum", "ppo_loss_sum", "ppo_token_terms", "token_logprobs"]
