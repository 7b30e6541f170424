"""Integrations with other libraries, each imported on its own (no third-party import here).

    import attention_ext.integrations.transformers as ae_hf
    ae_hf.register()   # attn_implementation="attention_ext" in Hugging Face transformers
"""
