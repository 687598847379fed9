"""Pure-functional models with stacked layer params."""
