"""nn.Module layers built on the scaledmm ops."""
