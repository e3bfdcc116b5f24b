"""draftsmith.common: building blocks every room may import (chat encoding, dtype names); imports
torch only."""
