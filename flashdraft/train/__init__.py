"""Drafter training (docs/design.md §4): data generation by the target, masks, loss, trainer (DDP)."""
