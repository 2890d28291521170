"""The frontend: a user's step and model become one traced TrainGraph (trace), with the user's activation
checkpoints marked (user_checkpoint), Mixture-of-Experts loops made traceable (moe_rewrites), fake kernels that reject
what the real ones accept routed around (fake_fixes); and models built without memory (init_empty)."""
