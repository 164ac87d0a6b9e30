"""The version tree of domains (DESIGN section 3): branches of the root's lower layers and PLOTs."""
