"""Stands in for a ComfyUI older than the pack supports: before any custom node loads (ComfyUI runs prestartup
scripts first), take away one thing the pack uses that older ComfyUI lacks (comfy.weight_adapter came later)."""
import comfy.weight_adapter

del comfy.weight_adapter.WeightAdapterBase
