"""Passes over captured programs: detection, rewrite, diff (installed as hlotool.passes)."""
