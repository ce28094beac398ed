"""A test pack with no nodes: its prestartup_script.py makes this ComfyUI look older than the pack supports."""
NODE_CLASS_MAPPINGS: dict = {}
