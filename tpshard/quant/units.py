"""The numbers both the layout table (tpshard.quant.formats) and the bit packers (tpshard.quant.packing)
are written in: the integer code widths tpshard packs and Marlin's tile.

What this file is not: anything that computes. It exists so that the layouts, which planning
imports without torch, and the packers, which need torch, take them from one place.
"""

SUPPORTED_BITS = (2, 3, 4, 8)  # int formats' code widths (GPTQ, AWQ, Marlin, compressed-tensors)
MARLIN_TILE = 16  # Marlin B rows are 16-row K strips; tiles are 16x16
