"""The pipeline's steps, one PTransform per module, and the engines they drive (worker side)."""
