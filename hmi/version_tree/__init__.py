"""The version tree of domains (docs/design.md, section 3): branches of the root's lower layers and PLOTs."""
