"""anima-ui: Anima (a 2B Diffusion Transformer) on the RK3588 NPU, with a phone-first Gradio app."""

__version__ = "0.1.0"
