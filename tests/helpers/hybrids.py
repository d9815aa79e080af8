"""Tiny hybrid (recurrent + attention) model shapes the schedule and engine tests share."""

# Nemotron-H's tiny attention and Mamba-2 mixers: 4 Mamba heads of 8, d_state 8 in
# 2 groups (under the family's own ``mamba_*`` aliases, which the zoo's overrides use), conv kernel 4
NEMOTRON_MIXERS = dict(
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    intermediate_size=48,
    mamba_num_heads=4,
    mamba_head_dim=8,
    ssm_state_size=8,
    mamba_n_groups=2,
    conv_kernel=4,
    sliding_window=None,
)
