"""Fitting what the correcting policies learn: anchor pools from calibration trajectories (`anchor_fit`) and the
acceptance-threshold sweep behind tune-tau (`tau`)."""
