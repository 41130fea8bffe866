"""Computer use: the desktop and browser of a sandbox (computer), credential fills (computer_fill,
fill_memory), screenshots (computer_screen) and the CDP redaction (cdp_mask)."""
