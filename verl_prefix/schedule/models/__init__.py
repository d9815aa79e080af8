"""What a model's structure needs: which layers attend, share K/V, recur (gated delta-net, Mamba) or route (MoE),
the known structures and capability checks, HF's forwards the schedule patches, and vision-language inputs."""
