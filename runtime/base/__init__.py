"""What every package of kiln shares, at the bottom of the runtime: the KilnError family,
installed versions, the per-user cache folder, JSON-lines reading. Standard library only.
"""
