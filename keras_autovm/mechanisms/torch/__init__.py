"""The torch mechanism (`mechanism.TorchMechanism`); imported only on torch."""
