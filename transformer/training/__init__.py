"""Training: state and run assembly, the pure steps, the loop, faults, checkpoints, optimizers."""
