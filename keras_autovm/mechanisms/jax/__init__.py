"""The JAX mechanism (`mechanism.JaxMechanism`); imported only on JAX."""
