"""A test source: documents with per-token loss masks, as a chat dataset has."""


class MaskedDocs:
  """Random-access documents with `loss_mask(i)`, like `ShardSource` over chat shards."""

  has_loss_mask = True

  def __init__(self, docs, masks):
    self.docs, self.masks = docs, masks

  def __len__(self):
    return len(self.docs)

  def __getitem__(self, i):
    return self.docs[i]

  def loss_mask(self, i):
    return self.masks[i]
