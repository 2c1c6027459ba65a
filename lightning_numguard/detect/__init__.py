"""What detects: the step's device-side checks (fused reductions, the packed flag vector, the output watch, the op
guard, optimizer coverage, spike statistics) and the declared checks. Torch and the standard library only."""
