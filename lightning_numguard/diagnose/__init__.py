"""What diagnoses: after a hit, the findings of a step in causal order and the culprit op, from a replay of the step
under the provenance trace. Torch and the standard library only."""
