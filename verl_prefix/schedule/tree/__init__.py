"""The tree schedule (prefix reuse at every level of a trie of shared prefixes): the trie, the schedule's node
forwards and backwards, node values and losses, dormant node K/V, the lockstep fillers, and per-node visual
inputs."""
