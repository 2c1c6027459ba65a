"""What decides: the escalation rule and the one judgement of a step's read (``judge``), and the memory of restores
that repeat. Torch and the standard library only."""
