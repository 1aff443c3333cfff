"""The latent attention template (kiln::latent_attention): MLA decode over a latent cache."""
