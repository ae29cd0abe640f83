"""The papers' published figures as data (`types`, `papers`) and the verdicts replay and simulate give on them
(`memory`, `serving`). No torch."""
