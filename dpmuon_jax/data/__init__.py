"""Image datasets: TFDS, local .npz files, the embedded digits; augmentation."""
