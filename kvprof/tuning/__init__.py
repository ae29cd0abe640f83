"""Fitting what the correcting policies learn: anchor pools (`anchor_fit`) and tune-tau's threshold sweep (`tau`)."""
